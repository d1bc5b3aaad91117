"""In-memory recovery (docs/recovery.md): after the fault of a rank whose optimizer stripes still
have a clean holder, the survivors stay up, a replacement is refilled from memory, and
training goes on. Framework-agnostic parts only: the rank's state machine (`machine`), the
recover-or-save decision (`decision`), which copies must agree (`verify`), a rank's side
(`rank`) and the controller's (`coordinator`). Megatron's side is mindio_ttp.megatron_ttp
(`rejoin`, `refill`, `transfer`); the launcher's is mindio_ttp.launch.replace."""
