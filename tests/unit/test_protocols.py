"""The Protocols that let a lower level name what it needs of a higher one are kept by what satisfies them: both
model families' models provide models/base.py's CausalLM (Ling's also DraftModel), and SamplingParams provides
core/step.py's DrawParams. Every member must exist, and every method must take the Protocol's parameters."""
from __future__ import annotations

import inspect
from typing import Protocol

import pytest

from hybridserve.core.step import DrawParams
from hybridserve.models.base import CausalLM, DraftModel
from hybridserve.models.registry import model_family
from hybridserve.sampling import SamplingParams
from tests.models.zaya_fixtures import tiny_config
from tests.reference.ling_naive import tiny_ling_config


def broken_members(protocol: type, obj: object) -> list[str]:
    """The members of `protocol` that `obj` lacks, or whose parameters differ from the Protocol's."""
    broken = []
    for cls in protocol.__mro__:
        if not issubclass(cls, Protocol) or cls is Protocol:
            continue
        for name, member in vars(cls).items():
            if name.startswith("_") and name != "__call__":
                continue
            if not hasattr(obj, name):
                broken.append(f"{name}: missing")
            elif inspect.isfunction(member) and name != "__call__":  # nn.Module's __call__ takes *args
                want = list(inspect.signature(member).parameters)
                got = ["self", *inspect.signature(getattr(obj, name)).parameters]
                if got != want:
                    broken.append(f"{name}: takes {got[1:]}, not {want[1:]}")
        broken += [f"{name}: missing" for name in vars(cls).get("__annotations__", {}) if not hasattr(obj, name)]
    return broken


def tiny_model(raw: dict):
    """A model built as the runtime builds it (models/registry.py), from a tiny config, with random weights."""
    family = model_family(raw)
    return family.model_class(family.parse_config(raw), None)


@pytest.mark.parametrize("raw", [tiny_config("base").to_dict(), tiny_ling_config()], ids=["zaya", "ling"])
def test_models_provide_causal_lm(raw: dict) -> None:
    assert broken_members(CausalLM, tiny_model(raw)) == []


def test_ling_provides_draft_model() -> None:
    assert broken_members(DraftModel, tiny_model(tiny_ling_config())) == []


def test_sampling_params_provide_draw_params() -> None:
    assert broken_members(DrawParams, SamplingParams()) == []


def test_broken_members_reports_what_is_wrong() -> None:
    class Wanted(Protocol):
        size: int

        def run(self, a: int, b: int) -> None: ...

        def stop(self) -> None: ...

    class Given:
        def run(self, a: int) -> None: ...

    assert broken_members(Wanted, Given()) == ["run: takes ['a'], not ['a', 'b']", "stop: missing", "size: missing"]
