"""The gateway's job path: what carries an admitted request to a worker and its answer back. The pools
(the catalog and the live workers: where a request goes), the plan cache, the lane queue's gateway side
(backpressure and refusals, :mod:`.queueing`), prefix-aware routing, the tokenizer cache the prompt-length
check counts with, and the reply router (one reader per process for every request it holds). The
request's own phases (admission, relay, settlement) are :mod:`flatfare.gateway.openai`'s."""
