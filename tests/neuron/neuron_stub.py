"""An INERT STUB of the Neuron-only packages, so that the real NeuronX Distributed imports on an ordinary CPU.

What it is: a meta-path finder (``install()``) that serves every ``torch_neuronx.*``, ``neuronxcc.*`` and
``libneuronxla.*`` module as an empty package whose attributes are inert placeholders: callable (with one function
argument it returns that function, so ``@nki_jit`` and ``@nki_jit(...)`` decorate as the identity), usable as base
classes, subscriptable and attribute-chainable. NxD 0.17 touches 48 such modules and 67 symbols at import time;
none of them does anything here.

What it is not: a fake of NxD or of torch-xla. Those are the real packages (NxD from the Neuron pip repository or a
local copy, and PyPI's torch-xla 2.9), running on torch-xla's CPU device; nothing here computes, records or checks
anything.
A code path that really needs neuronx-cc, NKI kernels, the Neuron runtime or ``torch_neuronx.trace`` gets a
placeholder and is not tested by the lane.

The cases that a plain "serve everything" stub gets wrong, each found by a real failure:

1. ``libneuronxla.libneuronpjrt_path`` (module and attribute) is NOT served: ``torch_xla/__init__.py`` would take
   its presence for a Neuron host and switch to the Neuron PJRT plugin (``TypeError: str expected``).
2. ``torch.classes.neuron.SPMDModel`` and ``LayoutTransformation`` exist: ``neuronx_distributed/trace/spmd.py``
   evaluates them in annotations at import.
3. ``torch_xla.core.xla_env_vars.HOST_WORLD_SIZE`` is defined (XRT-era name, gone in torch-xla 2.9) and its
   variable set to one host: ``parallel_layers/utils.py`` reads it whenever ``PJRT_DEVICE`` is not ``NEURON``.
4. ``torch_neuronx.utils.get_platform_target()`` returns ``"trn1"``: ``initialize_model_parallel`` and the GQA
   qkv layer turn it into NxD's ``hardware`` enum (``ValueError: ... is not a valid hardware`` otherwise).

The lane's virtual environment runs ``install()`` at interpreter start (a ``.pth`` file written by
``tests/neuron/setup_venv.sh``), so ``python train.py cluster=xla_cpu`` in that environment imports NxD too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

STUBBED = ("torch_neuronx", "neuronxcc", "libneuronxla")
NOT_SERVED = {("libneuronxla", "libneuronpjrt_path")}
NOT_SERVED_MODULES = {"libneuronxla.libneuronpjrt_path"}
XLA_ENV_VARS = "torch_xla.core.xla_env_vars"
HOST_WORLD_SIZE = "XRT_HOST_WORLD_SIZE"


class _InertMeta(type):
    """Metaclass of the placeholders: any attribute of a placeholder class is another placeholder class."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _InertMeta):
            return args[0]  # used as a decorator: the identity
        return super().__call__(*args, **kwargs)  # an instance: itself an identity decorator (``nki_jit(...)(fn)``)


class _Inert(metaclass=_InertMeta):
    """An instance of a placeholder: accepts any arguments, any attribute is a placeholder."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # ``nki_jit()(fn)``: the identity
        return _Inert()

    def __getitem__(self, item: Any) -> Any:
        return self


def _placeholder(name: str) -> type:
    return _InertMeta(name.rsplit(".", 1)[-1], (_Inert,), {"__qualname__": name, "__module__": __name__})


def _trn1(*args: Any, **kwargs: Any) -> str:
    return "trn1"


SPECIAL = {
    ("torch_neuronx.utils", "get_platform_target"): _trn1,
    ("torch_neuronx.utils.utils", "get_platform_target"): _trn1,
}
"""Attributes that must return a real value: NxD's ``hardware(get_platform_target())`` (parallel_state, qkv_linear)
takes the platform's name, here trn1, the platform hlat targets."""


class _StubModule(types.ModuleType):
    """A served Neuron module: a package whose every public attribute is a placeholder (except NOT_SERVED)."""

    def __getattr__(self, name: str) -> Any:
        if (name.startswith("__") and name.endswith("__")) or (self.__name__, name) in NOT_SERVED:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (hlat's Neuron stub)")
        if (self.__name__, name) in SPECIAL:
            return SPECIAL[self.__name__, name]
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: submodules import too
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real ``torch_xla.core.xla_env_vars``, then adds the XRT-era ``HOST_WORLD_SIZE`` (case 3)."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.real.exec_module(module)
        if not hasattr(module, "HOST_WORLD_SIZE"):
            module.HOST_WORLD_SIZE = HOST_WORLD_SIZE
        os.environ.setdefault(HOST_WORLD_SIZE, "1")  # one host: the lane's processes share this machine


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in NOT_SERVED_MODULES:
            return None  # not found: ImportError, as on a host without libneuronxla
        if name.split(".", 1)[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        if name == "neuronx_distributed":  # case 2, just before NxD imports (torch is importable by then)
            _torch_classes()
            return None
        if name == XLA_ENV_VARS:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
            return spec
        return None


def _torch_classes() -> None:
    """Case 2: the two TorchScript class names NxD's trace module annotates with."""
    import torch

    namespace = torch.classes.neuron
    for name in ("SPMDModel", "LayoutTransformation"):
        if name not in vars(namespace):
            setattr(namespace, name, type(name, (), {"__module__": "torch.classes.neuron"}))


def install() -> None:
    """Serve the Neuron-only modules from now on in this process (idempotent). Import torch_xla after this."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if any(m.split(".", 1)[0] in STUBBED for m in sys.modules):
        raise RuntimeError("a Neuron package was imported before the stub was installed")
    sys.meta_path.insert(0, _Finder())
