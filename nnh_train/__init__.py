"""nnh_train: DDP plumbing and a minimal trainer."""

__all__: list[str] = []
