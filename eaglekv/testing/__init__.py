"""Test-only helpers that ship with the package (fault injection for the reliability suite);
the engine never imports them."""
