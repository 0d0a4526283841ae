"""`VLLMEngine`'s LoRA adapters: attaching one, moving it to a new version (a PEFT directory and a vLLM `LoRARequest`
per version), and retiring versions no running request uses.

`LoraAdapters` is a mixin of `VLLMEngine` (engines built with `max_lora_rank`) and works on its state; the serving
thread calls `_apply_adapter` for a queued adapter load and `_retire_loras` when a request that used one finishes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from astratk.engines.adapters import AdapterView
from astratk.engines.calls import _settle
from astratk.engines.vllm_weights import LoadJob
from astratk.weights.delta import SparseDelta, apply_delta


@dataclass(eq=False)
class Adapter:
    """One LoRA adapter: its spec, host copy of its tensors (saved PEFT names), version and the vLLM request of
    that version (None until its first load is applied on the serving thread)."""

    lora: Any
    host: dict[str, torch.Tensor]
    version: int
    request: Any = None


class LoraAdapters:
    """`add_adapter`, `adapter_version`, `adapters` and the serving thread's side of adapter loads (`VLLMEngine`'s
    module docstring, "LoRA adapters")."""

    def _init_adapters(self) -> None:
        self._adapters: dict[str, Adapter] = {}
        self._lora_ids = itertools.count(1)
        self._lora_dirs: dict[int, str] = {}  # LoRARequest id -> its directory, until removed
        self._lora_root: str | None = None
        self._zero_lora: Any = None  # the all-zero adapter base requests run with (module docstring)

    def add_adapter(self, name: str, lora: Any, state: Mapping[str, torch.Tensor], version: int) -> Any:
        """Attach LoRA adapter `name` (`lora`: its `LoraSpec`) with tensors `state` (saved PEFT names) at `version`;
        returns its `AdapterView`. Needs an engine built with `max_lora_rank` >= `lora.r`."""
        from astratk.models.lora import check_adapter_fits

        if self._lora_rank is None:
            raise ValueError("add_adapter: this VLLMEngine was built without LoRA support; build it with "
                             "max_lora_rank (the largest adapter rank it will serve)")
        if lora.r > self._lora_rank:
            raise ValueError(f"add_adapter: rank {lora.r} exceeds the engine's max_lora_rank {self._lora_rank}")
        if name in self._adapters:
            raise ValueError(f"add_adapter: the engine already has an adapter {name!r}; load_weights moves it")
        check_adapter_fits(self._path, lora, state)
        host = {k: v.detach().to("cpu").clone() for k, v in state.items()}
        job = LoadJob(host, version, adapter=name)
        with self._cond:
            self._check_usable()
            self._adapters[name] = Adapter(lora, host, version)
            self._loads.append(job)
            self._cond.notify_all()
        try:
            job.future.result(self._load_timeout)
        except BaseException:
            with self._cond:
                self._adapters.pop(name, None)
            raise
        return AdapterView(self, name)

    def adapter_version(self, name: str) -> int:
        return self._adapter(name).version

    @property
    def adapters(self) -> list[str]:
        """The names of the attached LoRA adapters."""
        return list(self._adapters)

    def _adapter(self, name: str) -> Adapter:
        try:
            return self._adapters[name]
        except KeyError:
            raise KeyError(f"the engine has no adapter {name!r} (adapters: {sorted(self._adapters)}); attach it "
                           "with add_adapter") from None

    def _apply_adapter(self, load: LoadJob) -> None:
        """On the serving thread: the adapter's new version into its host copy, a directory and a new vLLM request;
        the previous version's request is retired once no running request uses it (`_retire_loras`). A failure
        leaves the adapter at its version (its old directory and request are untouched)."""
        adapter = self._adapters[load.adapter]
        try:
            host = _next_host(load, adapter)
            if self._zero_lora is None:
                zeros = {k: torch.zeros_like(v) for k, v in host.items()}
                self._zero_lora = self._add_lora("astratk-base", adapter.lora, zeros)
            request = self._add_lora(f"{load.adapter}@v{load.version}", adapter.lora, host)
        except BaseException as e:  # noqa: BLE001 - the caller gets it; the adapter stays where it was
            self._stats["errors"] += 1
            _settle(load.future, error=e)
            return
        adapter.host, adapter.version, adapter.request = host, load.version, request
        self._retire_loras()
        _settle(load.future, result=None)

    def _add_lora(self, name: str, lora: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
        """On the serving thread: `tensors` as a PEFT directory of this engine, added to vLLM under a new id."""
        from vllm.lora.request import LoRARequest

        from astratk.models.lora import write_adapter_dir

        if self._lora_root is None:
            self._lora_root = tempfile.mkdtemp(prefix="astratk-lora-")
        lora_id = next(self._lora_ids)
        path = write_adapter_dir(os.path.join(self._lora_root, str(lora_id)), lora, tensors, self._path)
        self._lora_dirs[lora_id] = str(path)
        request = LoRARequest(f"{name}#{lora_id}", lora_id, str(path))
        self._engine.add_lora(request)
        return request

    def _retire_loras(self) -> None:
        """Remove adapter versions that are no adapter's newest and that no running request uses."""
        live = {a.request.lora_int_id for a in self._adapters.values() if a.request is not None}
        if self._zero_lora is not None:
            live.add(self._zero_lora.lora_int_id)
        live |= {run.lora_id for run in self._running.values()}
        for lora_id in [i for i in self._lora_dirs if i not in live]:
            with contextlib.suppress(Exception):
                self._engine.remove_lora(lora_id)
            shutil.rmtree(self._lora_dirs.pop(lora_id), ignore_errors=True)


def _next_host(load: LoadJob, adapter: Adapter) -> dict[str, torch.Tensor]:
    """The adapter's tensors after `load` (a new dict: the current host copy is kept until the load succeeds)."""
    if isinstance(load.state, SparseDelta):
        if load.state.version != load.version or load.state.base_version != adapter.version:
            raise ValueError(f"adapter {load.adapter!r} is at version {adapter.version}; the delta goes "
                             f"{load.state.base_version} -> {load.state.version}: fetch a full state instead")
        host = {k: v.clone() for k, v in adapter.host.items()}
        apply_delta(host, load.state)  # checks names, shapes and dtypes before writing
        return host
    if set(load.state) != set(adapter.host):
        raise KeyError(f"adapter {load.adapter!r}: a full load must give all its tensors; unknown "
                       f"{sorted(set(load.state) - set(adapter.host))[:2]}, missing "
                       f"{sorted(set(adapter.host) - set(load.state))[:2]}")
    return {k: v.detach().to("cpu").clone() for k, v in load.state.items()}
