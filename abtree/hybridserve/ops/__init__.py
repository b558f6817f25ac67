"""One entry point per op (attention, moe, lightning, ...): the Triton kernel on CUDA, the pure-torch reference
(`ops.reference`) elsewhere, as `ops.backends` selected at start-up. `ops.triton` is imported lazily, so CPU
installs never import Triton."""
