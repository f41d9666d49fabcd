"""``hybridkv vllm-pd-proxy``: the PD proxy in front of a prefill and a decode vLLM server.

Invariants: the proxy is ``integrations.vllm.pd_proxy.PDProxy`` (imported inside the command, no
vLLM needed); the command serves until interrupted and closes its socket on the way out.
"""

from __future__ import annotations

import typer

from hybridkv.cli.app import app


@app.command("vllm-pd-proxy")
def vllm_pd_proxy(
    prefill: str = typer.Option(..., "--prefill", help="Base URL of the prefill vLLM (kv_role kv_producer)."),
    decode: str = typer.Option(..., "--decode", help="Base URL of the decode vLLM (kv_role kv_consumer)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Where the proxy listens."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="The proxy's port (0: any free one)."),
    timeout_s: float = typer.Option(600.0, "--timeout-s", min=1.0, help="Per upstream request."),
) -> None:
    """One OpenAI endpoint for a vLLM prefill/decode pair running HybridKVPDConnector: the prompt goes to
    prefill with max_tokens=1, its kv_transfer_params with the request to decode."""
    from hybridkv.integrations.vllm.pd_proxy import PDProxy

    proxy = PDProxy(prefill, decode, host, port, timeout_s)
    typer.echo(f"hybridkv PD proxy at {proxy.address}: prefill {proxy.prefill}, decode {proxy.decode}", err=True)
    try:
        proxy.server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        proxy.server.server_close()
