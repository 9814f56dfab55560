"""`prorsa gateway --nats URL`: the HTTP front door (OpenAI chat/completions, SGLang /generate) as its own process.

See `prorsa/gateway/app.py` for the endpoints. It prints `openai: http://HOST:PORT/v1` once it listens.
"""

from __future__ import annotations

import argparse

from prorsa.gateway.tool_parser import PARSERS


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = argparse.ArgumentDefaultsHelpFormatter
    p.formatter_class = d
    p.add_argument("--nats", default=None, help="NATS server URL (when not given: $PRORSA_NATS_URL)")
    p.add_argument(
        "--namespace", default=None, help="subject namespace (when not given: $PRORSA_NAMESPACE, else prorsa)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer directory with a chat template (needed for chat and text prompts; token ids work "
        "without)",
    )
    p.add_argument("--model-name", default="prorsa", help="the model id /v1/models lists and responses name")
    p.add_argument("--max-model-len", type=int, default=32768, help="prompt + output tokens a turn may hold")
    p.add_argument(
        "--max-concurrent-turns",
        type=int,
        default=4096,
        help="turns running at once; more get 429 Retry-After",
    )
    p.add_argument(
        "--admission-timeout-s",
        type=float,
        default=10.0,
        help="a turn the full work queues refuse this long is answered 429",
    )
    p.add_argument(
        "--session-idle-s",
        type=float,
        default=3600.0,
        help="a session (trajectory) with no request for this long is closed as aborted",
    )
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024, help="larger bodies get 413")
    p.add_argument(
        "--tool-parser",
        default="hermes",
        help=f"how tool calls are read from output: {', '.join(PARSERS)}, or any of vLLM's parsers where vLLM is "
        "installed (e.g. qwen3_coder, llama3_json)",
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from prorsa.gateway.app import HttpConfig
    from prorsa.gateway.server import ServeConfig, admin_api_key_from_env, api_key_from_env, serve
    from prorsa.gateway.turns import GatewayConfig
    from services.runtime.bus import namespace_from_env, nats_url_from_env
    from services.runtime.logging import configure_logging

    configure_logging()
    url = nats_url_from_env(args.nats)
    if not url:
        print("prorsa gateway: give --nats URL (or set PRORSA_NATS_URL)")
        return 2
    config = ServeConfig(
        nats_url=url,
        namespace=namespace_from_env(args.namespace),
        host=args.host,
        port=args.port,
        tokenizer=args.tokenizer,
        gateway=GatewayConfig(
            model_name=args.model_name,
            max_model_len=args.max_model_len,
            max_tokens_cap=args.max_model_len,
            session_idle_s=args.session_idle_s,
        ),
        http=HttpConfig(
            api_key=api_key_from_env(),
            admin_api_key=admin_api_key_from_env(),
            max_body_bytes=args.max_body_bytes,
            max_concurrent_turns=args.max_concurrent_turns,
            tool_parser=args.tool_parser,
        ),
        admission_timeout_s=args.admission_timeout_s,
    )
    print(f"openai: http://{args.host}:{args.port}/v1", flush=True)
    try:  # uvloop where installed (it comes with uvicorn's extras and with vLLM): less CPU per request
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
    return 0
