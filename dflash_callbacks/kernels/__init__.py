"""LM-head statistics (reference, chunked torch path, Triton kernel) and the closed-form DDTree.
Import the modules themselves (`kernels.head_stats`, `kernels.ddtree`); `kernels.types` holds what
they share."""
