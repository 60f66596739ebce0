#!/usr/bin/env bash
# Keep a command running on a `ray up` head: run it, and whenever it exits, log why and start it
# again after a back-off (5 s doubling to 60 s; back to 5 s after a run of 10 minutes or more).
# The head's start commands launch it in its own session, so `ray exec` returning and SSH hanging up
# do not stop it, and stop the previous one first (its pid is in PIDFILE):
#
#   setsid nohup bash supervise.sh PIDFILE COMMAND... >> LOG 2>&1 < /dev/null &
#   kill -- -"$(cat PIDFILE)"        # stops the supervisor and what it runs (one process group)
set -u
pidfile=$1
shift
echo $$ > "$pidfile"
delay=5
while true; do
    started=$(date +%s)
    echo "$(date -Is) supervise: starting: $*"
    "$@"
    status=$?
    if (( $(date +%s) - started >= 600 )); then delay=5; fi
    echo "$(date -Is) supervise: exited with status $status; starting again in ${delay} s"
    sleep "$delay"
    delay=$(( delay * 2 > 60 ? 60 : delay * 2 ))
done
