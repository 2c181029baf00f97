"""Every client call, once, apart from its transport: `Calls`, which `Client` runs
blocking and `AsyncClient` awaits (each call is a generator of steps,
`r3store_client.steps`). The calls are mixed in, each kind from its module:

- `call_base`: the client's state and pools, and the request every call sends, retried
  (`Retry`) and raising the project's errors (`r3store.errors`);
- `namespace_calls`: namespaces, their policy version, settings and statistics;
- `write_calls`: uploads, checked and encoded here; `direct_writes`, their direct half;
- `read_calls`: reads of routes by id, token ids, route refs, sampling;
  `direct_reads`, read plans and the object store's ranged GETs;
- `lease_calls`: leases, checkpoints and resume.
"""

from __future__ import annotations

from r3store_client.lease_calls import LeaseCalls
from r3store_client.write_calls import WriteCalls


class Calls(LeaseCalls, WriteCalls):
    """The client's state and its calls, for a transport to run (`Client`,
    `AsyncClient`)."""
