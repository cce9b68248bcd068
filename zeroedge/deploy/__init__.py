"""`zeroedge deploy / rollback / status` over SSH (asyncssh, imported lazily).

- inventory: targets and `--hosts FILE` inventories, checked line by line before anything connects
- ssh: connections (~/.ssh/config, ProxyJump hops opened here, every host key checked against an explicit
  known_hosts), the device agent runner, content-addressed SFTP upload into a private dir
- preflight: facts (zeroedge.device.probe, run on the device) + bundle manifest -> refuse or go
- release: the release content (bundle + device code + daemon.toml for a sensor bundle's daemon; with
  --serve, a model bundle's, the serve unit's spec instead), ids by content hash
- remote: the device-side agent (stdlib only): store, releases, atomic `current`, build, systemd, health
- (zeroedge/trust.py, beside bundle.py: what both ends check, shipped with the agent: safe paths, signatures)
- runner: two-phase fleet deploy, rollback and status in parallel
- cli: options and output shared by the three commands
"""
