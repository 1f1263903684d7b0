"""Adapters for third-party kernel packages (flash-attn ...), used when installed; one module per package."""
