"""The model: its config, the family registry, checkpoint loading and packing, the CausalLM with
its MTP layer, and the layers it is built from. Single device, no collectives, no cache of its
own: a forward writes and reads keys through the attention context the executor hands it."""
