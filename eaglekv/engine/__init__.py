from eaglekv.engine.engine import Engine

__all__ = ["Engine"]
