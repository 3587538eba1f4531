;; reject_shouting.wat - a kiproxy WebAssembly interceptor that rejects values that are all
;; upper case (at least one letter A-Z and none a-z). Anything else passes unchanged.
;;
;; Binary encoding, declared in its `kiproxy.interceptor` section; see uppercase.wat for
;; the layouts.
;;   transform        ABI v1, one record per call   (function: transform, abi: 1)
;;   transform_batch  ABI v2, the whole batch        (function: transform_batch, abi: 2)
;;
;;   interceptor:
;;     class: kiproxy.interceptors.builtin.wasm:WasmInterceptor
;;     config: {module: examples/wasm/reject_shouting.wat}       # abi: 2 picks transform_batch
;;
;; Both results are static data: status 2 ("unchanged") or status 1 followed by the reason.
;; A single rejected record rejects the whole batch, as a broker-side plugin would.
(module
  ;; Self-description: how the host calls this module, so `module:` alone is enough.
  (@custom "kiproxy.interceptor" "{\"function\":\"transform\",\"abi\":1,\"encoding\":\"binary\",\"functions\":{\"transform_batch\":{\"abi\":2}}}")
  (memory (export "memory") 1)
  (data (i32.const 16) "\02")
  (data (i32.const 32) "\01value is all upper case")   ;; 24 bytes
  (global $heap (mut i32) (i32.const 1024))
  (global $cursor (mut i32) (i32.const 0))

  (func $align8 (param $n i32) (result i32)
    (i32.and (i32.add (local.get $n) (i32.const 7)) (i32.const -8)))

  (func (export "alloc") (param $size i32) (result i32)
    (local $p i32) (local $end i32) (local $have i32)
    (local.set $p (global.get $heap))
    (local.set $end (call $align8 (i32.add (local.get $p) (local.get $size))))
    (local.set $have (i32.shl (memory.size) (i32.const 16)))
    (if (i32.gt_u (local.get $end) (local.get $have))
      (then
        (if (i32.eq
              (memory.grow (i32.shr_u (i32.add (i32.sub (local.get $end) (local.get $have))
                                               (i32.const 65535))
                                      (i32.const 16)))
              (i32.const -1))
          (then (return (i32.const 0))))))
    (global.set $heap (local.get $end))
    (local.get $p))

  (func (export "dealloc") (param $p i32) (param $size i32)
    (if (i32.eq (call $align8 (i32.add (local.get $p) (local.get $size))) (global.get $heap))
      (then (global.set $heap (local.get $p)))))

  (func $skip (param $p i32) (result i32)
    (local $n i32)
    (local.set $n (i32.load (local.get $p)))
    (i32.add (i32.add (local.get $p) (i32.const 4))
             (select (local.get $n) (i32.const 0) (i32.gt_s (local.get $n) (i32.const 0)))))

  ;; 1 when the n bytes at p hold an upper-case letter and no lower-case one.
  (func $shouting (param $p i32) (param $n i32) (result i32)
    (local $end i32) (local $b i32) (local $upper i32)
    (local.set $end (i32.add (local.get $p) (local.get $n)))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $p) (local.get $end)))
        (local.set $b (i32.load8_u (local.get $p)))
        (if (i32.lt_u (i32.sub (local.get $b) (i32.const 97)) (i32.const 26))
          (then (return (i32.const 0))))
        (if (i32.lt_u (i32.sub (local.get $b) (i32.const 65)) (i32.const 26))
          (then (local.set $upper (i32.const 1))))
        (local.set $p (i32.add (local.get $p) (i32.const 1)))
        (br $next)))
    (local.get $upper))

  ;; Whether the record at p shouts; leaves the position after the record in $cursor.
  (func $record_shouts (param $p i32) (result i32)
    (local $n i32) (local $headers i32) (local $loud i32)
    (local.set $p (call $skip (i32.add (local.get $p) (i32.const 8))))   ;; timestamp, key
    (local.set $n (i32.load (local.get $p)))
    (if (i32.gt_s (local.get $n) (i32.const 0))
      (then (local.set $loud (call $shouting (i32.add (local.get $p) (i32.const 4))
                                             (local.get $n)))))
    (local.set $p (call $skip (local.get $p)))
    (local.set $headers (i32.load (local.get $p)))
    (local.set $p (i32.add (local.get $p) (i32.const 4)))
    (block $done
      (loop $next
        (br_if $done (i32.eqz (local.get $headers)))
        (local.set $p (call $skip (call $skip (local.get $p))))
        (local.set $headers (i32.sub (local.get $headers) (i32.const 1)))
        (br $next)))
    (global.set $cursor (local.get $p))
    (local.get $loud))

  (func $unchanged (result i64) (i64.or (i64.shl (i64.const 16) (i64.const 32)) (i64.const 1)))
  (func $reject (result i64) (i64.or (i64.shl (i64.const 32) (i64.const 32)) (i64.const 24)))

  ;; ABI v1: one record.
  (func (export "transform") (param $ptr i32) (param $len i32) (result i64)
    (if (result i64) (call $record_shouts (i32.add (call $skip (local.get $ptr)) (i32.const 4)))
      (then (call $reject))
      (else (call $unchanged))))

  ;; ABI v2: the whole batch.
  (func (export "transform_batch") (param $ptr i32) (param $len i32) (result i64)
    (local $count i32) (local $p i32)
    (local.set $p (i32.add (call $skip (local.get $ptr)) (i32.const 4)))
    (local.set $count (i32.load (local.get $p)))
    (global.set $cursor (i32.add (local.get $p) (i32.const 4)))
    (block $done
      (loop $next
        (br_if $done (i32.eqz (local.get $count)))
        (if (call $record_shouts (global.get $cursor)) (then (return (call $reject))))
        (local.set $count (i32.sub (local.get $count) (i32.const 1)))
        (br $next)))
    (call $unchanged))
)
