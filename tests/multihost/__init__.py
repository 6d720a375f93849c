"""A fleet spread over hosts of its own on one machine: network namespaces on a bridge.

`hosts.py` makes the hosts (`Hosts`, `Host`: an address, an interface name, a hostname and a
state directory each; processes spawned inside; partitions made with iptables), `fleet.py`
runs llmgw on them (`Fleet`: a 3-server NATS cluster, placements, gateways, node agents),
`fixtures.py` the pytest fixtures (`net_admin`, `make_hosts`, `make_fleet`) that tests take.
Every name made here is this test's own: other tests run their clusters on the same machine.
"""
