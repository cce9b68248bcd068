"""The torch decode loop's parts: `fast` (Decoder: one decode step composed of an attention strategy
and an FFN strategy) and `memory` (a request's byte forecast under a device memory cap). The
serving session that picks them per request is zeroedge.serve.session. Import the submodules
(`fast` needs torch)."""
