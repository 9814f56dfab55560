"""The HTTP front door (issue 29): OpenAI-compatible chat/completions with a session = a trajectory, token-exact
ids and logprobs, SGLang's `/generate`, finish/abort; run by `prorsa gateway` and started by `prorsa up`.

Product layer: it reaches the bus through the client SDK (`prorsa.client`), like any trainer."""
