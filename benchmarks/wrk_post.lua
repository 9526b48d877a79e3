-- wrk script for the Coordinator benchmark: POST the JSON body in $WRK_BODY to the
-- URL given on wrk's command line, and print the request count, latency percentiles
-- and errors (non-2xx answers included) on one line that
-- benchmarks/coordinator_overhead.py parses.
wrk.method = "POST"
wrk.body = os.getenv("WRK_BODY")
wrk.headers["Content-Type"] = "application/json"

function done(summary, latency, requests)
  io.write(string.format("wrk-result requests=%d p50_us=%d p99_us=%d errors=%d\n",
    summary.requests, latency:percentile(50), latency:percentile(99),
    summary.errors.connect + summary.errors.read + summary.errors.write
      + summary.errors.status + summary.errors.timeout))
end
