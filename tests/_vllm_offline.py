"""One-process vLLM (`LLM`) driven by vLLM's own trainer factory; run by test_vllm.py.

    python tests/_vllm_offline.py MODEL_DIR '{"backend": "tcp", "prompts": [[...]], "max_tokens": N}'

Optional keys: `"tp": 2` (tensor parallel, the "mp" executor), `"slices": true` (each
rank receives only its slices: `fanout=Star(slices=True)`), `"shape": {...}` (the
model's `build_model` keywords, as the checkpoint was saved with).

Builds an `LLM` on the CPU with the weight-transfer backend `asyncwt_<backend>`
in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor), then pushes
rounds with `WeightTransferTrainerFactory.trainer_init(VllmTrainerInitInfo(...))`, a
vLLM `ModuleSource` and `LLMClient(llm)`: the seed-1 weights (`v1`), the seed-2
weights (`v2`) and the original weights (`v3`). Prints one line, `RESULT {json}`, with
the greedy tokens and the weight version vLLM reports after each step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def main(model_dir: str, spec: dict[str, Any]) -> dict[str, Any]:
    import _vllm_model
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from asyncwt import ShmTrainerInitInfo, Star, TcpTrainerInitInfo, TorchDistTrainerInitInfo
    from asyncwt._vllm.trainer import LLMClient, VllmTrainerInitInfo

    started = time.perf_counter()
    tp = spec.get("tp", 1)
    llm = LLM(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        tensor_parallel_size=tp,
        distributed_executor_backend="uni" if tp == 1 else "mp",
        seed=0,
        weight_transfer_config={"backend": "asyncwt_" + spec["backend"]},
    )
    result: dict[str, Any] = {"start_s": time.perf_counter() - started, "steps": []}
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True)

    def record(label: str, push_s: float | None = None) -> None:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False
        )
        result["steps"].append(
            {
                "label": label,
                "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                "weight_version": llm.get_weight_version(),
                "push_s": push_s,
            }
        )

    record("original")
    original = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    shape = spec.get("shape", {})
    trainer_model = _vllm_model.build_model(original.config.vocab_size, seed=1, **shape)
    info_cls = {
        "tcp": TcpTrainerInitInfo,
        "shm": ShmTrainerInitInfo,
        "torch_dist": TorchDistTrainerInitInfo,
    }[spec["backend"]]
    settings = {"fanout": Star(slices=True)} if spec.get("slices") else {}
    engine = WeightTransferTrainerFactory.trainer_init(
        VllmTrainerInitInfo(info_cls(rank=0, **settings)),
        client=LLMClient(llm),
        source=ModuleSource(trainer_model),
    )
    result["engine"] = type(engine).__name__
    try:
        for label, seed in (("v1", 1), ("v2", 2), ("v3", None)):
            if seed is None:
                trainer_model.load_state_dict(original.state_dict())
            else:
                _vllm_model.reseed(trainer_model, seed)
            t0 = time.perf_counter()
            stats = engine.send_weights(weight_version=label)
            record(label, time.perf_counter() - t0)
            result["steps"][-1].update(
                bytes=stats.bytes, wire_bytes=stats.wire_bytes, workers=stats.workers
            )
    finally:
        engine.shutdown()
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    out = main(sys.argv[1], json.loads(sys.argv[2]))
    print("RESULT " + json.dumps(out), flush=True)
