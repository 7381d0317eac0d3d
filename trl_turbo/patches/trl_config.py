"""Inject trl_turbo's fields into TRL's GRPOConfig in place (reversibly).

Design: rather than a subclass (which `trl.GRPOConfig(...)` in user code would never see), a throw-away dataclass
`make_dataclass(name, fields, bases=(cls,))` generates the `__init__`/`__repr__`/`__eq__` that know the new fields;
those methods, the merged `__dataclass_fields__` and `__annotations__` are then set on the original class through the
patch registry, so class identity is kept and `unpatch()` restores every original object. `__post_init__` is wrapped
to run trl_turbo's validation after TRL's own. Subclasses that already exist (e.g. TRL's GMPOConfig, user configs)
get the same treatment, since their generated `__init__` would otherwise reject the new keyword arguments.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from .. import config as turbo_config
from .. import registry
from ..checks import check_config


def _all_subclasses(cls: type) -> list[type]:
    result, stack = [], [cls]
    while stack:
        current = stack.pop()
        result.append(current)
        stack.extend(current.__subclasses__())
    return result


def _wrap_post_init(original_post_init):
    @functools.wraps(original_post_init)
    def __post_init__(self, *args, **kwargs):
        original_post_init(self, *args, **kwargs)
        check_config(self)

    __post_init__.__trl_turbo__ = True
    return __post_init__


def _inject(cls: type) -> None:
    existing = cls.__dataclass_fields__
    new_fields = [f for f in turbo_config.TURBO_FIELDS if f.name not in existing]
    if not new_fields:
        return
    specs = [(f.name, f.type, dataclasses.field(default=f.default, metadata=f.metadata)) for f in new_fields]
    generated = dataclasses.make_dataclass(cls.__name__, specs, bases=(cls,), repr=True, eq=True)
    for attr in ("__init__", "__repr__", "__eq__"):
        method = generated.__dict__[attr]
        method.__qualname__ = f"{cls.__qualname__}.{attr}"
        registry.set_attr(cls, attr, method)
    registry.set_attr(cls, "__match_args__", generated.__match_args__)
    registry.set_attr(cls, "__dataclass_fields__", dict(generated.__dataclass_fields__))
    annotations = dict(cls.__dict__.get("__annotations__", {}))
    annotations.update({f.name: _evaluated_type(f.type) for f in new_fields})
    registry.set_attr(cls, "__annotations__", annotations)
    for f in new_fields:
        registry.set_attr(cls, f.name, f.default)
    post_init = cls.__dict__.get("__post_init__")
    if post_init is not None and not getattr(post_init, "__trl_turbo__", False):
        registry.set_attr(cls, "__post_init__", _wrap_post_init(post_init))


def _evaluated_type(annotation: Any) -> Any:
    # config.py uses postponed annotations; parsers call get_type_hints(), which needs real types or evaluable strings
    if isinstance(annotation, str):  # our own literal annotations such as "int | None", or a type of config.py's
        return eval(annotation, vars(turbo_config), {})  # noqa: S307
    return annotation


def apply() -> None:
    from trl.trainer.grpo_config import GRPOConfig

    for cls in _all_subclasses(GRPOConfig):
        if dataclasses.is_dataclass(cls):
            _inject(cls)
