"""Embedded PyTorch engine: model, paged KV cache, scheduler, runner, server."""
