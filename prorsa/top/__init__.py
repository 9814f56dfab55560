"""`prorsa top`: a live terminal view of a running cluster. `state` is the pure core (bus messages in, a view
model out), `render` draws the view with rich, `prorsa.commands.top` is the thin shell on NATS."""
