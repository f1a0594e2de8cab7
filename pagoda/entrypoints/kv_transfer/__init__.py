"""The HTTP side of prefill-decode disaggregation (pagoda/kv_transfer/ moves the KV blocks):

- ``api``     ``GET /v1/kv_transfer/info`` on an instance with a KV role (added to the
              OpenAI server's app)
- ``router``  the router's app and ``pagoda router``: one client request's two halves run on
              a prefill and a decode instance, the decode instance's answer streamed back
"""
