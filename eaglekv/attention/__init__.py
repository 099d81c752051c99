from eaglekv.attention.backend import AttentionBackend, TorchAttentionBackend

__all__ = ["AttentionBackend", "TorchAttentionBackend"]
