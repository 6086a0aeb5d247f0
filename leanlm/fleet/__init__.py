"""Data-parallel serving: `leanlm serve` replicas (ordinary processes, plain HTTP) behind one cache-aware front
(SGLang's router). It builds on the server's public pieces (`leanlm.server`) and the process helpers of
`leanlm.parallel.machine`; nothing below it imports it."""
