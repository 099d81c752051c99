"""Speculative decoding: EAGLE-family drafts, draft KV indexing, tree verify and acceptance."""
