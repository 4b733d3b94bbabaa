-- wrk script for bench/wrk.py: POST one body file with the given headers; at the end, one JSON line.
--   wrk -t1 -c16 -d5s -s bench/wrk.lua URL -- BODY_FILE "name: value" ...
-- A response is counted as read once wrk's HTTP parser saw its end (for a stream: the last chunk).

function init(args)
   local f = assert(io.open(args[1], "rb"))
   wrk.body = f:read("*a")
   f:close()
   wrk.method = "POST"
   for i = 2, #args do
      local name, value = args[i]:match("^([^:]+):%s*(.*)$")
      wrk.headers[name] = value
   end
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      '{"requests": %d, "duration_us": %d, "bytes": %d, "connect": %d, "read": %d, "write": %d, ' ..
      '"status": %d, "timeout": %d, "p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, "mean_us": %.1f}\n',
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
