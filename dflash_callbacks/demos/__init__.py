"""The demo and its toy world. The library proper never imports this package."""
