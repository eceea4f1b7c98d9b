"""A rollout worker: asyncwt's worker server plus a `/rollouts` route using the same model.

Run by `async_rl_loop.py` and `plain_trainer.py` (`_bandit.rollout_worker()` starts
it); on its own: `python examples/rollout_worker.py --port 8000`.

What it shows:

- how to host a model behind asyncwt's weight-transfer routes (`build_app`) and
  serve inference from the very same `nn.Module`, so rollouts use the weights the
  trainer pushed;
- how to keep inference and weight updates apart. The `"tcp"` worker writes
  received bytes straight into the model's parameter memory, so a forward pass
  running during a round would read a mix of two versions. A small
  reader/writer gate (`WeightsGate`) wraps the weight-transfer routes:
  `POST /start_weight_update` closes the gate (new rollouts wait) and waits for
  rollouts in flight to finish before any byte lands; a successful
  `POST /finish_weight_update` records the version the worker just published and
  reopens the gate. A round that fails leaves the gate closed (its weights are
  half-written) until a later round completes;
- how each rollout batch is tagged: with the version published when it was
  generated (`None` before the first round: the factory's initial weights), plus a
  digest of the exact weights used, so the trainer can check the tag.

Routes: everything `asyncwt worker` serves (see `asyncwt.build_app`), and

    POST /rollouts {"contexts": [[float]*CONTEXT_DIM]*N, "seed": int}
      -> {"actions": [int]*N, "log_probs": [float]*N,
          "weight_version": str | null, "weights_digest": str}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import torch
from _bandit import make_policy, sample_actions, weights_digest  # examples/, beside this file
from aiohttp import web

from asyncwt import WeightTransferConfig, build_app

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
GATE_TIMEOUT_S = 60.0


# --8<-- [start:gate]
class WeightsGate:
    """Rollouts read the weights; a round (start → finish) writes them. Never both at once."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._updating = False
        self.version: str | None = None
        """The version the worker published last (`None`: the initial weights)."""

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/start_weight_update":
            async with self._cond:
                self._updating = True  # rollouts that arrive from now on wait
                await self._cond.wait_for(lambda: self._readers == 0)  # let running ones end
            return await handler(request)
        if request.path == "/finish_weight_update":
            response = await handler(request)  # raises when the round failed: gate stays shut
            if response.status == 200:
                body = await request.json()  # aiohttp caches the body the handler read
                async with self._cond:
                    self.version, self._updating = body.get("weight_version"), False
                    self._cond.notify_all()
            return response
        return await handler(request)

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[str | None]:
        """Hold the weights still; yield the version they are."""
        async with self._cond:
            await asyncio.wait_for(self._cond.wait_for(lambda: not self._updating), GATE_TIMEOUT_S)
            self._readers += 1
            version = self.version
        try:
            yield version
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()


def build_rollout_app(model: torch.nn.Module) -> web.Application:
    gate = WeightsGate()
    app = build_app(model, config=WeightTransferConfig(backend="tcp"))
    app.middlewares.append(gate.middleware)

    async def rollouts(request: web.Request) -> web.Response:
        body = await request.json()
        contexts = torch.tensor(body["contexts"], dtype=torch.float32)
        seed = int(body["seed"])
        try:
            async with gate.reading() as version:
                # Off the event loop: the weight-transfer routes keep being served.
                actions, logp = await asyncio.to_thread(sample_actions, model, contexts, seed)
                digest = await asyncio.to_thread(weights_digest, model)
        except asyncio.TimeoutError:
            return web.json_response(
                {"error": f"the weights have been changing for over {GATE_TIMEOUT_S} s"},
                status=503,
            )
        return web.json_response(
            {
                "actions": actions.tolist(),
                "log_probs": logp.tolist(),
                "weight_version": version,
                "weights_digest": digest,
            }
        )

    app.router.add_post("/rollouts", rollouts)
    return app


# --8<-- [end:gate]


async def serve(host: str, port: int) -> None:
    runner = web.AppRunner(build_rollout_app(make_policy()))
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        print(f"rollout worker listening on http://{bound_host}:{bound_port}", flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
