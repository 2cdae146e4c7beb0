"""Where samples go: the durable spool, the forwarder that ships it, and the InfluxDB writers.

    spool.Spool            every sample is appended here first (line protocol segments on local disk)
    forwarder.Forwarder    ships the spool to a LineWriter from a persisted cursor; an outage loses nothing
    influx.V1Writer        POST /write (InfluxDB 1.x, and 2.x/3.x through their v1 compatibility API)
    influx.V2Writer        /api/v2/write through influxdb-client (1.8+, 2.x, 3.x)

Submodules are not imported here so that reading a spool back (`soakd report`) does not pull in the
HTTP clients.
"""
