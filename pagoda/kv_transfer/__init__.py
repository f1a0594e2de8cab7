"""Prefill-decode (PD) disaggregation: moving a request's KV blocks between engine instances.

A prefill instance (``pagoda serve --kv-role prefill``) computes a request's prompt, samples
its first token and keeps the request's KV blocks pinned ("parked") under a transfer id
instead of decoding on. A decode instance (``--kv-role decode``) fetches those blocks into
free blocks of its own pool and decodes from the first token on, as if it had computed the
prompt itself. ``pagoda router`` (pagoda/entrypoints/kv_transfer/router.py) runs the two
halves of one client request on a prefill and a decode instance and streams the decode
instance's answer.

The modules:

- ``blocks``     a KV cache's blocks as byte rows: layout checks, gather, install
- ``connector``  the KV connector: ``KVSender`` (prefill side: parked blocks served on a
                 ZMQ endpoint) and ``KVReceiver`` (decode side: fetches), over one of two
                 payload transports, shared memory (one host) or TCP frames (any hosts)
- ``engine``     the engine core's side: parking, fetching, and handing arrived requests
                 to the scheduler (``PDTransfer``)

What a request carries (``kv_transfer_params``) and an instance's ``--kv-transfer-config``
are options: pagoda/config/kv_transfer.py. The HTTP side (``GET /v1/kv_transfer/info`` and the router) is an entry point:
pagoda/entrypoints/kv_transfer/.

docs/parallel.md ("Prefill-decode disaggregation") says how to run it and what happens on failure.
"""
