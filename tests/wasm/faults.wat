;; Test module: every way a module can fail. Binary encoding, ABI v1 unless noted.
;;   spin             loops forever (runs out of fuel, or is interrupted at the deadline)
;;   spin_on_bang     loops forever when the value starts with "!", else "unchanged"
;;   trap             divides by zero
;;   oom              grows memory until it cannot, then traps
;;   bad_pointer      returns a result outside its memory
;;   bad_status       returns status byte 7
;;   truncated        returns status 0 and three bytes of a record
;;   bad_json         returns status 0 and text that is not JSON
;;   empty_batch      ABI v2: returns status 0 and a batch of zero records
;;   bad_alloc_*      see the modules built inline by the tests
(module
  ;; Self-description: every failing function, binary unless noted.
  (@custom "kiproxy.interceptor" "{\"function\":\"trap\",\"encoding\":\"binary\",\"functions\":{\"spin\":{},\"spin_on_bang\":{},\"oom\":{},\"bad_pointer\":{},\"bad_status\":{},\"truncated\":{},\"bad_json\":{\"encoding\":\"json\"},\"empty_batch\":{\"abi\":2}}}")
  (memory (export "memory") 1)
  (data (i32.const 16) "\02")
  (data (i32.const 24) "\07")
  (data (i32.const 32) "\00abc")
  (data (i32.const 40) "\00{not json")
  (data (i32.const 56) "\00\00\00\00\00")
  (global $heap (mut i32) (i32.const 1024))

  (func (export "alloc") (param $size i32) (result i32)
    (local $p i32)
    (local.set $p (global.get $heap))
    (global.set $heap (i32.add (local.get $p) (local.get $size)))
    (if (i32.gt_u (global.get $heap) (i32.shl (memory.size) (i32.const 16)))
      (then (if (i32.eq (memory.grow (i32.add (i32.shr_u (local.get $size) (i32.const 16))
                                              (i32.const 1)))
                        (i32.const -1))
              (then (return (i32.const 0))))))
    (local.get $p))

  (func $result (param $p i32) (param $n i32) (result i64)
    (i64.or (i64.shl (i64.extend_i32_u (local.get $p)) (i64.const 32))
            (i64.extend_i32_u (local.get $n))))

  (func (export "spin") (param $ptr i32) (param $len i32) (result i64)
    (loop $forever (br $forever))
    (i64.const 0))

  (func (export "spin_on_bang") (param $ptr i32) (param $len i32) (result i64)
    (local $p i32) (local $n i32)
    ;; topic, partition, timestamp
    (local.set $p (i32.add (i32.add (local.get $ptr) (i32.const 16)) (i32.load (local.get $ptr))))
    ;; key
    (local.set $n (i32.load (local.get $p)))
    (local.set $p (i32.add (i32.add (local.get $p) (i32.const 4))
                           (select (local.get $n) (i32.const 0)
                                   (i32.gt_s (local.get $n) (i32.const 0)))))
    (if (i32.and (i32.gt_s (i32.load (local.get $p)) (i32.const 0))
                 (i32.eq (i32.load8_u (i32.add (local.get $p) (i32.const 4))) (i32.const 33)))
      (then (loop $forever (br $forever))))
    (call $result (i32.const 16) (i32.const 1)))

  (func (export "trap") (param $ptr i32) (param $len i32) (result i64)
    (drop (i32.div_u (i32.const 1) (i32.const 0)))
    (i64.const 0))

  (func (export "oom") (param $ptr i32) (param $len i32) (result i64)
    (loop $more (br_if $more (i32.ne (memory.grow (i32.const 1)) (i32.const -1))))
    unreachable)

  (func (export "bad_pointer") (param $ptr i32) (param $len i32) (result i64)
    (call $result (i32.const 0x7fff0000) (i32.const 10)))

  (func (export "empty_result") (param $ptr i32) (param $len i32) (result i64)
    (call $result (i32.const 0) (i32.const 0)))

  (func (export "bad_status") (param $ptr i32) (param $len i32) (result i64)
    (call $result (i32.const 24) (i32.const 1)))

  (func (export "truncated") (param $ptr i32) (param $len i32) (result i64)
    (call $result (i32.const 32) (i32.const 4)))

  (func (export "bad_json") (param $ptr i32) (param $len i32) (result i64)
    (call $result (i32.const 40) (i32.const 10)))

  (func (export "empty_batch") (param $ptr i32) (param $len i32) (result i64)
    (call $result (i32.const 56) (i32.const 5)))
)
