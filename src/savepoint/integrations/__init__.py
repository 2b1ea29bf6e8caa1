"""savepoint inside other frameworks' checkpointing: each module imports its framework only when
used (``savepoint.integrations.dcp`` for ``torch.distributed.checkpoint``)."""

__all__: list[str] = []
