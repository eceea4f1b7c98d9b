"""Adapter rounds into a one-process vLLM (`LLM`); run by test_vllm.py.

    python tests/_vllm_adapter.py MODEL_DIR '{"backend": "tcp", "prompts": [[...]], "max_tokens": N}'

Builds an `LLM` with LoRA enabled and asyncwt's `asyncwt_<backend>` weight transfer,
then: pushes a PEFT LoRA adapter with `AdapterSource(..., name="policy")` (drawn from
seed 1: `a1`), again (seed 2: `a2`), then the base weights of seed 1 with a
`ModuleSource` (`base1`). After each step it generates greedily with the adapter
(`LoRARequest("policy", 1, adapter_path("policy"))`) and without it. Prints one line,
`RESULT {json}`: the tokens, each push's seconds and bytes.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ADAPTER = "policy"
RANK = 4
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def peft_model(base: Any, adapter_seed: int) -> Any:
    """`base` (a transformers model) with a LoRA adapter drawn from `adapter_seed`."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(base, config)
    reseed_adapter(model, adapter_seed)
    return model.eval()


def reseed_adapter(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))


def merged(vocab_size: int, base_seed: int, adapter_seed: int) -> Any:
    """What HF computes: the base of `base_seed` with the adapter merged in."""
    import _vllm_model

    model = peft_model(_vllm_model.build_model(vocab_size, seed=base_seed), adapter_seed)
    return model.merge_and_unload().eval()


def main(model_dir: str, spec: dict[str, Any]) -> dict[str, Any]:
    import _vllm_model
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from asyncwt import AdapterSource, ModuleSource, TcpTrainerInitInfo, trainer_init
    from asyncwt._vllm.adapters import adapter_path
    from asyncwt._vllm.trainer import LLMClient

    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        distributed_executor_backend="uni",
        seed=0,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
        weight_transfer_config={"backend": "asyncwt_" + spec["backend"]},
    )
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)
    lora = LoRARequest(ADAPTER, 1, adapter_path(ADAPTER))
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    result: dict[str, Any] = {"steps": []}

    def generate(request: Any) -> list[list[int]]:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=request)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def push(source: Any, version: str) -> None:
        import anyio

        async def run() -> Any:
            client = LLMClient(llm)
            engine = await trainer_init(TcpTrainerInitInfo(rank=0), client=client, source=source)
            async with engine:
                first = await engine.send_weights(weight_version=version)
                if version == "a1":  # the latency of further rounds on a warm connection
                    times = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        await engine.send_weights(weight_version=version)
                        times.append(time.perf_counter() - t0)
                    result["adapter_round_s"] = sorted(times)
                return first

        stats = anyio.run(run)
        result["steps"].append(
            {
                "label": version,
                "bytes": stats.bytes,
                "wall_s": stats.wall_s,
                "adapter": generate(lora),
                "base": generate(None),
            }
        )

    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    vocab = original.config.vocab_size
    result["model_bytes"] = sum(p.numel() * p.element_size() for p in original.parameters())
    trainer = peft_model(_vllm_model.build_model(vocab, seed=0), adapter_seed=1)
    result["adapter_bytes"] = sum(
        p.numel() * p.element_size() for n, p in trainer.named_parameters() if ".lora_" in n
    )
    push(AdapterSource(trainer, name=ADAPTER), "a1")
    reseed_adapter(trainer, 2)
    push(AdapterSource(trainer, name=ADAPTER), "a2")
    push(ModuleSource(_vllm_model.build_model(vocab, seed=1)), "base1")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = main(sys.argv[1], json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(out), flush=True)
