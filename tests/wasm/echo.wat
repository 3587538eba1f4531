;; Test module: returns its input unchanged, in the shape of a result.
;;   echo_json    status 0 + the input JSON (topic and partition are ignored by the host);
;;                works for ABI v1 and v2
;;   echo_binary  status 0 + the input after topic and partition; ABI v1 and v2
;; `alloc` is a bump allocator; results are written just above the heap.
(module
  ;; Self-description (the config's abi picks v1 or v2: both functions serve both).
  (@custom "kiproxy.interceptor" "{\"function\":\"echo_json\",\"encoding\":\"json\",\"functions\":{\"echo_binary\":{\"encoding\":\"binary\"}}}")
  (memory (export "memory") 1)
  (global $heap (mut i32) (i32.const 1024))

  (func $reserve (param $end i32) (result i32)
    (local $have i32)
    (local.set $have (i32.shl (memory.size) (i32.const 16)))
    (if (i32.gt_u (local.get $end) (local.get $have))
      (then
        (if (i32.eq
              (memory.grow (i32.shr_u (i32.add (i32.sub (local.get $end) (local.get $have))
                                               (i32.const 65535))
                                      (i32.const 16)))
              (i32.const -1))
          (then (return (i32.const 0))))))
    (i32.const 1))

  (func (export "alloc") (param $size i32) (result i32)
    (local $p i32) (local $end i32)
    (local.set $p (global.get $heap))
    (local.set $end (i32.and (i32.add (i32.add (local.get $p) (local.get $size)) (i32.const 7))
                             (i32.const -8)))
    (if (i32.eqz (call $reserve (local.get $end))) (then (return (i32.const 0))))
    (global.set $heap (local.get $end))
    (local.get $p))

  (func $copy_out (param $from i32) (param $n i32) (result i64)
    (local $out i32)
    (local.set $out (global.get $heap))
    (if (i32.eqz (call $reserve (i32.add (i32.add (local.get $out) (i32.const 1)) (local.get $n))))
      (then unreachable))
    (i32.store8 (local.get $out) (i32.const 0))
    (memory.copy (i32.add (local.get $out) (i32.const 1)) (local.get $from) (local.get $n))
    (i64.or (i64.shl (i64.extend_i32_u (local.get $out)) (i64.const 32))
            (i64.extend_i32_u (i32.add (local.get $n) (i32.const 1)))))

  (func (export "echo_json") (param $ptr i32) (param $len i32) (result i64)
    (call $copy_out (local.get $ptr) (local.get $len)))

  (func (export "echo_binary") (param $ptr i32) (param $len i32) (result i64)
    (local $body i32)
    (local.set $body (i32.add (i32.add (local.get $ptr) (i32.const 8))
                              (i32.load (local.get $ptr))))          ;; topic, partition
    (call $copy_out (local.get $body)
                    (i32.sub (i32.add (local.get $ptr) (local.get $len)) (local.get $body))))
)
