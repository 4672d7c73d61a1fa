"""spmd.lowering: graph capture and the passes that turn a model into a runnable plan."""

__all__: list[str] = []
