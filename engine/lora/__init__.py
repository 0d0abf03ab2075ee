"""LoRA adapters (issue 55): PEFT directories read onto baton's projections (adapter.py), the
batched per-row delta (layer.py), the slot table and its LRUs (slots.py), the offline request
(request.py). Each row of a step applies its own adapter: its slot travels in the metadata."""
