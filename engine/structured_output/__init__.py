"""Structured outputs (JSON schema, regex, choice, grammar, structural tag) with xgrammar.

spec.py checks a StructuredOutputs before anything runs and maps it to xgrammar; schema/ lowers
a JSON schema into what the grammar engine enforces exactly; grammars.py is the engine's side:
the compile thread, the per-step bitmask and the matchers (imported from there: it needs torch,
which the server, a user of the check, does without).
"""

from baton.engine.structured_output.spec import check_structured_outputs

__all__ = ["check_structured_outputs"]
