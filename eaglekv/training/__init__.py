"""Offline training of draft heads (not on the serving path)."""
