"""A vLLM plugin that makes `reload_weights` take effect on vLLM's CPU build (polar's weight sync needs it).

vLLM 0.32 on a CPU prepacks each linear layer's weight at load time (oneDNN, or the sgl AMX kernel) and keeps
the packed copy in a closure, `layer.cpu_linear` (`vllm/model_executor/layers/utils.py`,
`dispatch_cpu_unquantized_gemm`). The layerwise `reload_weights` copies new values into the layers'
parameters but not into those closures, so after a reload the server keeps computing its linear layers with
the old weights, answers 200 and says nothing. With this plugin linear layers call `torch.nn.functional.linear`
on their weight parameter, which the reload updates in place. It costs the prepacked kernels' speed; GPUs
are not affected (the plugin does nothing there). `VLLM_PLUGINS=` (empty) turns it off for one server.

Installed into the vLLM venv by polar's `scripts/install-vllm-cpu`; vLLM loads it in every process from the
`vllm.general_plugins` entry point before the model is built.
"""

from __future__ import annotations


def register() -> None:
    import torch
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return

    def read_the_weight_at_call_time(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = read_the_weight_at_call_time
