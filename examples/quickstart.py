"""Quickstart: train a small model and push its weights to a worker after every step.

Start a worker first, from this folder (`python -m` makes `quickstart` importable):

    python -m asyncwt worker --model quickstart:make_model --port 8100

then run `python quickstart.py` (or `python quickstart.py http://HOST:PORT`).
"""

import sys

import anyio
import torch

from asyncwt import HttpClient, ModuleSource, TcpTrainerInitInfo, trainer_init


def make_model() -> torch.nn.Module:
    """The worker builds the same architecture; the trainer's weights replace its own."""
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))


async def main(url: str) -> None:
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    async with HttpClient(url) as client:
        engine = await trainer_init(
            TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(model)
        )
        async with engine:  # shuts the engine down at the end
            for step in range(1, 4):
                inputs = torch.randn(32, 64)
                loss = torch.nn.functional.mse_loss(model(inputs), inputs[:, :1])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                # Streams the weights to the worker; returns once it has published them.
                stats = await engine.send_weights(weight_version=f"step-{step}")
                (status,) = await client.weights_status()
                print(f"step {step}: {stats.summary()}; worker at {status['weight_version']}")


if __name__ == "__main__":
    anyio.run(main, sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8100")
