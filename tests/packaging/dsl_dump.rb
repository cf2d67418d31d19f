# Reads a Homebrew formula or cask without Homebrew: loads it against stand-ins for `Formula`
# and `cask` that record every DSL call (name, arguments, and the calls inside its block), and
# prints them as JSON for tests/packaging/test_packaging.py. Method bodies (`install`) and the
# `test do` block are not run. Usage: ruby dsl_dump.rb FILE.rb
require "json"

# One level of DSL calls. A call with no arguments returns what an earlier call of that name
# set (so `#{version}` in a cask's url reads the cask's version). A BasicObject, so that DSL
# names Kernel also has (`test`, `format`, `system`) reach method_missing.
class Recorder < BasicObject
  # Blocks that hold code to run on a Mac, not declarations: recorded, not evaluated.
  OPAQUE = %w[test install postflight preflight uninstall_postflight uninstall_preflight].freeze

  attr_reader :calls

  def initialize
    @calls = []
  end

  def record(name, args, kwargs, block)
    name = name.to_s
    if args.empty? && kwargs.empty? && block.nil?
      earlier = @calls.reverse.find { |call| call["name"] == name }
      return earlier && earlier["args"].first
    end
    call = { "name" => name, "args" => kwargs.empty? ? args : args + [kwargs] }
    if block && !OPAQUE.include?(name)
      inner = ::Recorder.new
      inner.instance_eval(&block)
      call["block"] = inner.calls
    end
    @calls << call
    nil
  end

  def method_missing(name, *args, **kwargs, &block)
    record(name, args, kwargs, block)
  end

  def respond_to_missing?(*)
    true
  end
end

# The formula's class body runs against this: every class-level call is recorded.
class Formula
  class << self
    attr_reader :recorder

    def inherited(subclass)
      super
      subclass.instance_variable_set(:@recorder, Recorder.new)
      $formula = subclass
    end

    def method_missing(name, *args, **kwargs, &block)
      recorder.record(name, args, kwargs, block)
    end

    # Kernel#test would answer `test do ... end` otherwise.
    def test(*args, **kwargs, &block)
      recorder.record(:test, args, kwargs, block)
    end

    def respond_to_missing?(*)
      true
    end
  end
end

def cask(token, &block)
  recorder = Recorder.new
  recorder.instance_eval(&block)
  $cask = [token, recorder]
end

file = ARGV.fetch(0)
load File.expand_path(file)
if $formula
  puts JSON.pretty_generate({ "kind" => "formula", "class" => $formula.name, "calls" => $formula.recorder.calls })
elsif $cask
  puts JSON.pretty_generate({ "kind" => "cask", "token" => $cask[0], "calls" => $cask[1].calls })
else
  abort "dsl_dump: #{file} defines neither a Formula subclass nor a cask"
end
