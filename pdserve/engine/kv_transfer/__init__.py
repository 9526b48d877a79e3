"""KV-cache transfer between prefill and decode engines: connector and transports."""
