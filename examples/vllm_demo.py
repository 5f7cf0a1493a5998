"""``make demo-vllm``: two real vLLM servers joined by kvferry, beside a single instance.

Builds a tiny random Llama locally, starts a single vLLM server (the
reference), a prefill server and a decode server with ``KvferryConnector``
(one core each), sends a few prompts through the proxy protocol (prefill with
``max_tokens=1``, then decode with prefill's ``kv_transfer_params``) and
prints decode's tokens beside the single instance's, and decode's prompt
token sources from its ``/metrics``. Exits 1 unless every token matches.
"""

from __future__ import annotations

import random
import sys
import tempfile

from harness.vllm import VOCAB, ServerSpec, VLLMServer, build_tiny_model, complete, free_port, pd_complete


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvferry-vllm-demo-") as tmp:
        model = build_tiny_model(f"{tmp}/model")
        extra = {"kvferry_bootstrap_addr": f"127.0.0.1:{free_port()}", "kvferry_node": "prefill0"}
        base = {"kv_connector": "KvferryConnector", "kv_connector_module_path": "transfer.adapters.vllm"}
        specs = [ServerSpec("single", model, 0),
                 ServerSpec("prefill", model, 0, {**base, "kv_role": "kv_producer",
                                                  "kv_connector_extra_config": {**extra,
                                                                                "kvferry_serve_bootstrap": True}}),
                 ServerSpec("decode", model, 1, {**base, "kv_role": "kv_consumer",
                                                 "kv_connector_extra_config": extra})]
        servers = []
        try:
            for spec in specs:
                servers.append(VLLMServer(spec, tmp))
            print("starting a single instance, a prefill and a decode server (about a minute) ...", flush=True)
            for s in servers:
                s.wait_ready()
            single, prefill, decode = servers
            rng = random.Random(0)
            ok = True
            for n in (120, 480, 960):
                prompt = [rng.randrange(4, VOCAB) for _ in range(n)]
                ref = complete(single, model, prompt, 12)
                got = pd_complete(prefill, decode, model, prompt, 12)
                same = got.tokens == ref.tokens
                ok &= same
                print(f"prompt of {n} tokens:\n  single instance: {ref.tokens}\n  prefill->decode: {got.tokens}"
                      f"  {'equal' if same else 'DIFFERENT'}  ({got.total_s:.2f} s)")
            print(f"decode's prompt tokens by source: {decode.metrics()}")
        finally:
            for s in servers:
                s.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
