"""The ``bertjax`` subcommands that are not config-driven runs, each a thin entry point (its
``main(argv)``) into the library: ``embed``, ``mine-negatives`` (mine), ``evaluate`` (score),
``evaluate-mlm`` (mlm_eval), ``extract-features`` and ``plot``; ``args`` holds their shared flag
parsing. ``bertjax.cli`` dispatches to them; nothing in the library imports them."""
