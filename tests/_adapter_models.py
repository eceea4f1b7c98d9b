"""A small base model, a PEFT-shaped LoRA model over it, and a worker that shows its output.

`python tests/_adapter_models.py` serves `base()` with asyncwt's tcp worker engine
(the server of `asyncwt worker`, plus `GET /probe`: the model's output on `PROBE`) and
prints `URL http://...` once listening. The trainer side (the test) holds a
`peft_like()` model: named and configured as a PEFT LoRA model (`peft_config`,
`...q_proj.lora_A.default.weight`), without needing peft installed.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import torch

HIDDEN = 16
RANK = 4
ALPHA = 8.0
TARGETS = ("q_proj", "v_proj")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.v_proj = torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(torch.tanh(self.q_proj(x)) * self.v_proj(x))


class Base(torch.nn.Module):
    """Two blocks; the names a language model's layers have (`layers.0.q_proj`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def base(seed: int = 0) -> Base:
    torch.manual_seed(seed)
    return Base()


PROBE = torch.linspace(-1, 1, 3 * HIDDEN).reshape(3, HIDDEN)


class LoraLinear(torch.nn.Module):
    """PEFT's `lora.Linear` layout: `base_layer`, `lora_A.default`, `lora_B.default`."""

    def __init__(self, base_layer: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = torch.nn.ModuleDict(
            {"default": torch.nn.Linear(base_layer.in_features, RANK, bias=False)}
        )
        self.lora_B = torch.nn.ModuleDict(
            {"default": torch.nn.Linear(RANK, base_layer.out_features, bias=False)}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = ALPHA / RANK
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * scale


class PeftLike(torch.nn.Module):
    """`base_model.model.<base>` with LoRA layers on `TARGETS`, and a `peft_config`."""

    def __init__(self, model: Base) -> None:
        super().__init__()
        for block in model.layers:
            for target in TARGETS:
                setattr(block, target, LoraLinear(getattr(block, target)))
        self.base_model = torch.nn.Module()
        self.base_model.model = model
        self.peft_config = {
            "default": SimpleNamespace(
                peft_type="LORA",
                r=RANK,
                lora_alpha=ALPHA,
                target_modules={*TARGETS},
                bias="none",
                use_dora=False,
                use_rslora=False,
            )
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base_model.model(x)
        return out


def peft_like(seed: int) -> PeftLike:
    """A LoRA model over `base(0)` whose adapter weights are drawn from `seed`."""
    model = PeftLike(base(0))
    reseed_adapter(model, seed)
    return model


def reseed_adapter(model: PeftLike, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def merged(model: PeftLike, base_model: Base) -> Base:
    """`base_model` with `model`'s adapter merged into a copy of its weights (W + s·B·A)."""
    out = base()
    out.load_state_dict(base_model.state_dict())
    lora = dict(model.named_modules())
    with torch.no_grad():
        for i, block in enumerate(out.layers):
            for target in TARGETS:
                layer = lora[f"base_model.model.layers.{i}.{target}"]
                delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight
                getattr(block, target).weight += delta * (ALPHA / RANK)
    return out


async def _serve() -> None:
    from aiohttp import web

    from asyncwt import WeightTransferConfig, build_app

    model = base(0)
    app = build_app(model, config=WeightTransferConfig(backend="tcp"))

    async def probe(request: web.Request) -> web.Response:
        with torch.no_grad():
            return web.json_response(model(PROBE).tolist())

    app.router.add_get("/probe", probe)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    print(f"URL http://127.0.0.1:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    try:
        asyncio.run(_serve())
    except KeyboardInterrupt:
        sys.exit(0)
