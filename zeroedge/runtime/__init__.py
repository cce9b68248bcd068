"""Serving: `session` (ServingSession: release gates pick the mechanisms per request, then a torch
decoder or a bundle runner) and `fast` (Decoder: one decode step composed of an attention strategy
and an FFN strategy). Import the submodules (they need torch)."""
