"""Every report factory writes, and the parts they share.

- ``plan_text``: a plan's tables, for the terminal (``factory plan``) and ``report.md``;
- ``run_metrics``, ``run_plots``, ``run_page``: a training run's ``metrics.jsonl``, its plots
  and its page (``factory report``, and the end of ``factory train``);
- ``build_folder``, ``build_page`` and its ``build_sections_*``: the ``factory build`` folder's
  layout and its one page;
- shared by all: ``html_parts`` (escaping, tables, notes, figures), ``units`` (numbers for
  people) and the SVG pictures ``bar_chart``, ``layer_stack``, ``memory_bars``.

Nothing is imported here: the CLI loads ``plan_text`` and ``build_folder`` at start-up and
must stay light.
"""
