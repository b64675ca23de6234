"""The kernels' CPU executor, float64 references and the helpers the kernel tests share."""


def configure(monkeypatch, **changes) -> None:
    """The kernel settings (rq_core.kernels.config.config()) with `changes` in force for one test."""
    from dataclasses import replace

    from rq_core.kernels import config as env

    monkeypatch.setattr(env, "_CONFIG", replace(env.config(), **changes))
