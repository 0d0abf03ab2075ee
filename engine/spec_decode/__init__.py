"""Speculative decoding: drafters (the checkpoint's MTP head, n-gram prompt lookup), the
verification of k + 1 tokens per request in one forward (a mode of the one metadata builder),
acceptance, and counters. The scheduler's half (verify rows, scratch slots, rollback) is
engine/core/scheduler_spec.py."""
