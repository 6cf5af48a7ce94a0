# tools: what tools/accuracy_sweeps.sh and tools/passkey_grid.sh share (sourced, not run).
#
# run_sweep NAME COMMAND...: when $sweeps (" name1 name2 ") names NAME, runs COMMAND with
# `--out $out/NAME`, its report into $out/NAME.txt.
run_sweep() {
  local name=$1
  shift
  [[ $sweeps == *" ${name} "* ]] || return 0
  echo "== $name" >&2
  "$@" --out "$out/$name" >"$out/$name.txt"
}
