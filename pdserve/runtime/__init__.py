"""What every pdserve process runs that is not a schema: tokenizer and detokenizer,
security (cluster token, TLS, interceptors), logging, the HTTP side-server runner,
the engine client, block hashing, throttled logging and a worker thread's queue
loop. Imports only ``pdserve.api``; every component may import it."""
